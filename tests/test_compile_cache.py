"""The persistent compilation cache: a second process on the same host loads the program the
first one compiled instead of compiling it again; the config refuses a cache in the store."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diloco_core.config import ConfigError
from diloco_core.config_loading import config_from_mapping

REPO = Path(__file__).resolve().parent.parent

# One fresh process: enable the cache, compile one program, report JAX's cache events.
COMPILE = """
import json, sys
import jax, jax.numpy as jnp
from jax import monitoring
from resources.compile_cache import enable_compilation_cache
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
enable_compilation_cache(sys.argv[1], min_compile_seconds=0)
@jax.jit
def f(x):
    for _ in range(8):
        x = jnp.tanh(x @ x.T)
    return x
f(jnp.ones((32, 32))).block_until_ready()
print(json.dumps(events))
"""


def _compile_once(directory: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", COMPILE, str(directory)], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_compiled_program_from_the_cache(tmp_path):
    cache = tmp_path / "jax-cache"
    first = _compile_once(cache)
    assert "/jax/compilation_cache/cache_hits" not in first
    assert any(p.name.startswith("jit_f-") for p in cache.iterdir())
    second = _compile_once(cache)
    assert "/jax/compilation_cache/cache_hits" in second


def test_an_empty_directory_turns_it_off_and_a_url_is_refused():
    from resources.compile_cache import enable_compilation_cache

    assert enable_compilation_cache("") is None
    with pytest.raises(ConfigError, match="orchestration.compilation_cache_dir"):
        config_from_mapping({"orchestration": {"compilation_cache_dir": "gs://bucket/jax"}})
