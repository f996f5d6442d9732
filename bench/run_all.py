"""Run every benchmark and print one JSON report (``make bench``).

    python bench/run_all.py [--quick]

Each benchmark measures its baseline in the same run and reports ratios;
absolute figures do not compare across machines or runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(script: str, *args: str) -> dict:
    print(f"running bench/{script} {' '.join(args)}", file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, str(HERE / script), "--json", *args], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench/{script} failed with exit code {done.returncode}")
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds")
    args = parser.parse_args()
    throughput_args = ["--rounds", "3", "--rollouts", "100"] if args.quick else ["--rounds", "7", "--rollouts", "300"]
    report = {
        "journal_throughput": run("journal_throughput.py", *throughput_args),
        "recovery": run("recovery.py", *(["--quick"] if args.quick else [])),
        "signing_cost": run("signing_cost.py", *(["--rounds", "2", "--rollouts", "8"] if args.quick else [])),
        "replay_scan": run("replay_scan.py", *(["--events", "100000", "--rounds", "1"] if args.quick else [])),
        "services": run("services.py", *(["--rounds", "2", "--groups", "2", "--siblings", "2"] if args.quick else [])),
        "snapshot_state": run("snapshot_state.py", *(["--rounds", "3", "--repeat", "50"] if args.quick else [])),
        "snapshot_blocks": run("snapshot_blocks.py", *(["--turns", "4,16", "--rounds", "1"] if args.quick else [])),
        "prefix_recovery": run(
            "prefix_recovery.py", *(["--crashes", "2", "--rounds", "3", "--tokens", "192"] if args.quick else [])
        ),
        "training_data": run("training_data.py", *(["--groups", "1", "--turns", "2"] if args.quick else [])),
        "gateway": run("gateway.py", *(["--quick"] if args.quick else [])),
        "fleet_scale": run(
            "fleet_scale.py", *(["--members", "20", "--partitions", "64", "--broker-kills", "1"] if args.quick else [])
        ),
        "restore_history": run(
            "restore_history.py", *(["--live", "20", "--rounds", "1", "--segment-ms", "1000"] if args.quick else [])
        ),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
