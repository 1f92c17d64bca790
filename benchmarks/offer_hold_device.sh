#!/usr/bin/env bash
# The offer-hold benchmark (benchmarks/offer_hold.py) on an accelerator, where the issue's floor
# ("none beyond the copy out of device memory") is a real device-to-host copy: the three settings
# measured on CPU (bf16/rebase, int4/rebase, bf16/overwrite) at the CPU run's batch, and the
# defaults at a batch an accelerator would train on. Results go to DIR (default
# benchmarks/results), one JSON per setting, each naming its device.
#
#     bash benchmarks/offer_hold_device.sh [DIR]
set -euo pipefail
out=${1:-benchmarks/results}
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
run() { python3 benchmarks/offer_hold.py --repeats 21 "$@"; }
run --out "$out/offer_hold_device.json"
run --encoding int4 --out "$out/offer_hold_device_int4.json"
run --receive-rule overwrite --out "$out/offer_hold_device_overwrite.json"
run --batch-size 32 --out "$out/offer_hold_device_batch32.json"
