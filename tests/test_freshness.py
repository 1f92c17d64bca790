"""benchmarks/freshness.py: a result file is stale once the code it measures changed after its
commit, and "under other defaults" once a default it depends on changed value."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.freshness import (  # noqa: E402
    assess,
    default_values,
    measured_names,
    measured_paths,
    recorded_command,
    recorded_commits,
    result_files,
)

CONFIG = '''"""Config."""

class SyncConfig:
    """Sync."""

    sync_period: int = {period}  # {comment}
    num_fragments: int = 4


class OuterOptConfig:
    lr: float = 0.5
'''
LAUNCH = 'ORCHESTRATED_DEFAULTS = ["name=demo", "sync.num_fragments=2"]\n'


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return _git(repo, "rev-parse", "HEAD")


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    return tmp_path


def _result(repo: Path, name: str, payload: dict) -> Path:
    path = repo / "benchmarks" / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))
    return path


def test_a_result_goes_stale_with_its_code_and_says_which_defaults_moved(repo):
    measured = _commit(repo, {"diloco_core/config.py": CONFIG.format(period=16, comment="H"),
                              "pipelines/launch_defaults.py": LAUNCH,
                              "diloco_core/merge.py": "x = 1\n"}, "measured")
    soak = _result(repo, "chaos_soak.json", {"commit": {"commit": measured},
                                             "command": "python benchmarks/chaos_soak.py"})
    pinned = _result(repo, "hostile_soak.json", {
        "runs": [{"commit": measured[:7],
                  "command": "python benchmarks/hostile_soak.py --set sync.sync_period=8"}]})
    merge = _result(repo, "merge_cost.json", {"commit": measured,
                                              "command": "python benchmarks/merge_cost.py"})

    assert assess(soak, repo).verdict == "current"
    _commit(repo, {"README.md": "words\n"}, "docs only")
    assert assess(soak, repo).verdict == "current"

    # A reworded comment or docstring changes nothing the interpreter sees: still current.
    _commit(repo, {"diloco_core/config.py": CONFIG.format(period=16, comment="sync period")},
            "comment")
    _commit(repo, {"diloco_core/merge.py": '"""Merges."""\nx = 1\n'}, "docstring")
    assert assess(soak, repo).verdict == "current"
    # Code changes it (coarse: re-run before quoting), though no default moved.
    code = _commit(repo, {"diloco_core/merge.py": '"""Merges."""\nx = 2\n'}, "code")
    r = assess(soak, repo)
    assert (r.verdict, r.code_changes, r.defaults_changes) == ("stale", [code[:7]], [])

    _commit(repo, {"diloco_core/config.py": CONFIG.format(period=8, comment="sync period")},
            "H = 8")
    r = assess(soak, repo)
    assert r.verdict == "stale, other defaults"
    assert r.defaults_changes == ["SyncConfig.sync_period: 16 -> 8"]
    # The run that set H itself is not under another default; a merge's cost has none.
    assert assess(pinned, repo).defaults_changes == []
    assert assess(pinned, repo).commit == measured[:7]
    assert assess(merge, repo).defaults_changes == []

    # The demo's defaults are the launch defaults laid over the config's; the chaos soak
    # builds its config without them, so a launch default does not reach its runs.
    demo = _result(repo, "orchestration_demo.json", {
        "commit": measured, "command": "python benchmarks/orchestration_demo.py"})
    before = assess(soak, repo).defaults_changes
    _commit(repo, {"pipelines/launch_defaults.py": LAUNCH.replace("=2", "=8")}, "P = 8")
    assert "SyncConfig.num_fragments: 2 -> 8" in assess(demo, repo).defaults_changes
    assert assess(soak, repo).defaults_changes == before

    # An embedded default moves while the launch defaults pin its old value, spelt otherwise
    # ("0.5" in the config, "5e-1" in the launch list): the demo's runs keep their meaning.
    _commit(repo, {"diloco_core/config.py": CONFIG.format(period=8, comment="H").replace(
                       "lr: float = 0.5", "lr: float = 0.7"),
                   "pipelines/launch_defaults.py": LAUNCH.replace("=2", "=8").replace(
                       '"name=demo"', '"name=demo", "outer.lr=5e-1"')}, "outer lr 0.7")
    assert "OuterOptConfig.lr: 0.5 -> 0.7" in assess(soak, repo).defaults_changes
    assert not any(c.startswith("OuterOptConfig.lr") for c in assess(demo, repo).defaults_changes)


def test_a_commit_outside_this_history_is_unknown_not_current(repo):
    _commit(repo, {"diloco_core/merge.py": "x = 1\n"}, "one")
    r = assess(_result(repo, "merge_cost.json", {"commit": "0" * 40, "command": "c"}), repo)
    assert (r.commit, r.verdict) == (None, "unknown commit")


def test_results_beside_the_quality_experiments_are_assessed_and_theirs_are_not(repo):
    """The quality experiments' reports mark their own stale runs (by code hash); the real-path
    runs kept beside them are orchestrated, outside that hash, so they are listed here."""
    soak = _result(repo, "chaos_soak.json", {"command": "python benchmarks/chaos_soak.py"})
    report = _result(repo, "quality/exp1_baselines.json",
                     {"command": "python benchmarks/quality_benchmarks.py 1"})
    real = _result(repo, "quality/real_path.json",
                   {"command": "python benchmarks/quality_real_path.py"})
    _result(repo, "quality/runs/0123456789abcdef.json", {"label": "a run"})
    files = result_files(repo / "benchmarks" / "results")
    assert soak in files and real in files
    assert report not in files and len(files) == 2


def test_commits_and_commands_are_found_where_results_keep_them():
    assert recorded_commits({"commit": "abc1234 (HEAD, clean)"}) == ["abc1234"]
    assert recorded_commits({"new": {"commit": "a" * 40}, "old": {"commit": "b" * 40}}) == [
        "a" * 40, "b" * 40]
    assert recorded_commits({"runs": [{"commit": "1234567"}, {"commit": "89abcde"}]}) == [
        "1234567", "89abcde"]
    assert recorded_commits({"note": "at 1234567"}) == []    # only under a "commit" key
    assert recorded_command({"runs": [{"command": "python x.py"}]}) == "python x.py"


def test_defaults_are_read_field_by_field_comments_dropped():
    values = default_values(CONFIG.format(period=16, comment="= 3 # not a default"), LAUNCH)
    assert values == {"SyncConfig.sync_period": "16", "SyncConfig.num_fragments": "2",
                      "OuterOptConfig.lr": "0.5", "ExperimentConfig.name": "demo"}
    # Wrapped (a long annotation, a value over several lines with a comment inside): read as
    # one line; a string that only looks like a launch default, outside the list, is not one.
    wrapped = CONFIG.format(period=16, comment="H") + (
        '\n\nclass LearnersConfig:\n'
        '    corpus: Literal[\n        "stdlib", "tiny"] = "stdlib"\n'
        '    speeds: list = field(default_factory=lambda: [1.0,  # fast\n'
        '                                                  0.5])\n')
    values = default_values(wrapped, LAUNCH + 'EXAMPLE = "run with sync.sync_period=4"\n')
    assert values["LearnersConfig.corpus"] == "stdlib"
    assert values["LearnersConfig.speeds"] == "field(default_factory=lambda: [1.0, 0.5])"
    assert values["SyncConfig.sync_period"] == "16"


def test_a_benchmark_is_measured_against_its_own_code_and_the_benchmark_modules_it_imports(repo):
    """The orchestrated scavenging benchmark is not the simulator's (`scavenging`, a prefix of
    its name): it measures the whole product and the scoring it imports."""
    _commit(repo, {"benchmarks/scavenging.py": "x = 1\n",
                   "benchmarks/quality/store_scoring.py": "y = 1\n",
                   "benchmarks/scavenging_orchestrated.py":
                       "def f():\n    from benchmarks.quality.store_scoring import y\n"}, "one")
    simulated = measured_paths("scavenging", repo)
    orchestrated = measured_paths("scavenging_orchestrated", repo)
    # The simulated one, through the quality runner: what the quality code hash covers, not
    # the experiments' arms or reports beside it.
    assert "resources" not in simulated and "benchmarks/quality/runner.py" in simulated
    assert not {"benchmarks/quality", "benchmarks/quality/experiments.py"} & set(simulated)
    assert {"resources", "pipelines", "benchmarks/quality/store_scoring.py",
            "benchmarks/scavenging_orchestrated.py"} <= set(orchestrated)
    assert "benchmarks/scavenging.py" not in orchestrated


def test_a_module_a_benchmark_takes_names_from_measures_it_only_through_those_names(repo):
    """The simulated scavenging takes `Arm` and a constant from the experiments' module: a new
    experiment's arms there leave its result current; a change to what `Arm` is (a default
    it reads from a module constant, in turn) makes it stale."""
    experiments = ("from dataclasses import dataclass\n\nTOKENS = 5\nDECOUPLED = 'd'\n\n"
                   "@dataclass\nclass Arm:\n    tokens: int = TOKENS\n\nARMS = ({arms})\n")
    measured = _commit(repo, {
        "benchmarks/quality/experiments.py": experiments.format(arms="1,"),
        "benchmarks/scavenging.py":
            "from benchmarks.quality.experiments import DECOUPLED, Arm\nx = Arm()\n",
        "benchmarks/final_rounds.py": "from benchmarks.quality import experiments\n"}, "one")
    assert measured_names("scavenging", repo) == {
        "benchmarks/quality/experiments.py": frozenset({"Arm", "DECOUPLED"})}
    assert measured_names("final_rounds", repo) == {}          # imported whole
    simulated = _result(repo, "scavenging.json", {
        "commit": measured, "command": "python benchmarks/scavenging.py"})
    whole = _result(repo, "final_rounds.json", {
        "commit": measured, "command": "python benchmarks/final_rounds.py"})

    _commit(repo, {"benchmarks/quality/experiments.py": experiments.format(arms="1, 2")},
            "a new arm")
    assert assess(simulated, repo).verdict == "current"
    assert assess(whole, repo).verdict == "stale"
    budget = _commit(repo, {"benchmarks/quality/experiments.py":
                            experiments.format(arms="1, 2").replace("= 5", "= 6")}, "budget")
    assert assess(simulated, repo).code_changes == [budget[:7]]


def test_the_real_path_section_of_the_results_page_marks_itself_stale(monkeypatch):
    """Every experiment-1 report rewrites the real-path section of docs/results.md, so a
    hand-written "stale" line there is erased: the section must carry freshness's verdict on
    real_path.json itself, and say nothing where it is current."""
    import benchmarks.freshness as freshness
    from benchmarks.freshness import Freshness
    from benchmarks.quality.report import OUT_DIR, real_path_section

    command = "python benchmarks/quality_real_path.py"
    stale = Freshness("r", "quality_real_path", "e63b61c", command, ["abc1234"],
                      ["InnerOptConfig.clip_norm: 1.0 -> 0.5"])
    monkeypatch.setattr(freshness, "assess", lambda path: stale)
    text = real_path_section(OUT_DIR / "real_path.json")
    assert ("**Stale: the defaults changed since (InnerOptConfig.clip_norm: 1.0 -> 0.5).** "
            f"Re-run with `{command}`") in text, text
    code_only = Freshness("r", "quality_real_path", "e63b61c", command, ["abc1234"], [])
    monkeypatch.setattr(freshness, "assess", lambda path: code_only)
    assert "**Stale: 1 commit(s) since changed the code it measures.**" in \
        real_path_section(OUT_DIR / "real_path.json")
    current = Freshness("r", "quality_real_path", "e63b61c", command, [], [])
    monkeypatch.setattr(freshness, "assess", lambda path: current)
    assert "Stale" not in real_path_section(OUT_DIR / "real_path.json")


def test_a_change_to_a_results_provenance_record_leaves_its_figures_current(repo):
    """Naming the CPU model in `machine_info` (through a helper and a constant only it uses,
    as `code_revision` reads its NOT_CODE_* paths) changes what a result says about its
    machine, not a figure in it; a change beside it does count."""
    reporting = ('import platform\n\n\ndef machine_info():\n    return {{"platform": {platform}}}'
                 '\n\n{helper}\ndef results_table(rows):\n    return [round(r, {digits}) '
                 'for r in rows]\n')
    measured = _commit(repo, {"pipelines/reporting.py": reporting.format(
        platform="platform.platform()", helper="", digits=4)}, "measured")
    soak = _result(repo, "chaos_soak.json", {"commit": measured,
                                             "command": "python benchmarks/chaos_soak.py"})
    _commit(repo, {"pipelines/reporting.py": reporting.format(
        platform="platform.platform(), CPU_KEY: cpu_model()",
        helper='CPU_KEY = "cpu"\n\n\ndef cpu_model():\n    return platform.processor()\n\n',
        digits=4)}, "cpu")
    assert assess(soak, repo).verdict == "current"
    rounding = _commit(repo, {"pipelines/reporting.py": reporting.format(
        platform="platform.platform(), CPU_KEY: cpu_model()",
        helper='CPU_KEY = "cpu"\n\n\ndef cpu_model():\n    return platform.processor()\n\n',
        digits=3)}, "rounding")
    assert assess(soak, repo).code_changes == [rounding[:7]]


def test_a_default_moved_and_pinned_back_for_the_demo_leaves_the_demo_current(repo):
    """e5fee76 moved the embedded inner lr and pinned the demo's at its old value: the demo's
    runs are the same runs (current); the soak built on the embedded defaults is under another
    default (said once, in its column, not again as a code change); a benchmark whose
    figures do not stand on the defaults counts the config's change as code."""
    measured = _commit(repo, {"diloco_core/config.py": CONFIG.format(period=16, comment="H"),
                              "pipelines/launch_defaults.py": LAUNCH}, "measured")
    demo = _result(repo, "orchestration_demo.json", {
        "commit": measured, "command": "python benchmarks/orchestration_demo.py"})
    soak = _result(repo, "chaos_soak.json", {"commit": measured,
                                             "command": "python benchmarks/chaos_soak.py"})
    merge = _result(repo, "merge_cost.json", {"commit": measured,
                                              "command": "python benchmarks/merge_cost.py"})
    moved = _commit(repo, {
        "diloco_core/config.py": CONFIG.format(period=8, comment="H"),
        "pipelines/launch_defaults.py": LAUNCH.replace('"]', '", "sync.sync_period=16"]')},
        "H = 8, the demo keeps 16")
    assert (assess(demo, repo).verdict, assess(demo, repo).code_changes) == ("current", [])
    s = assess(soak, repo)
    assert (s.verdict, s.code_changes) == ("stale, other defaults", [])
    assert s.defaults_changes == ["SyncConfig.sync_period: 16 -> 8"]
    assert assess(merge, repo).code_changes == [moved[:7]]
    # A default written over several lines is read as one that is not: rewrapping it changes
    # nothing, and its new value is a default's change, in that column only.
    wide = CONFIG.format(period=8, comment="H").replace(
        "num_fragments: int = 4", "num_fragments: int = (  # P\n        4)")
    _commit(repo, {"diloco_core/config.py": wide}, "the same value, over two lines")
    assert (assess(demo, repo).verdict, assess(demo, repo).code_changes) == ("current", [])
    _commit(repo, {"diloco_core/config.py": wide.replace("4)", "2)")}, "P = 2")
    assert (assess(demo, repo).verdict, assess(demo, repo).code_changes) == ("current", [])
    s = assess(soak, repo)
    assert (s.verdict, s.code_changes) == ("stale, other defaults", [])
    assert s.defaults_changes == ["SyncConfig.num_fragments: 4 -> 2",
                                  "SyncConfig.sync_period: 16 -> 8"]
    # More than a value (a validator beside the defaults) is code for every benchmark.
    validator = _commit(repo, {"diloco_core/config.py": wide.replace("4)", "2)")
                               + "\n\ndef check(c):\n    assert c.sync_period > 0\n"},
                        "a validator")
    assert assess(demo, repo).code_changes == [validator[:7]]
