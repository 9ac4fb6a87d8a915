"""Pool fidelity-suite results (`scripts/measure_real.py` JSON) by question and print the paired tables.

Runs of several invocations or machines over the same contexts (the same seeds and dense answers) pair question by
question, e.g. a new strategy's run beside an earlier run's flat and rank=keys:

    python scripts/pool_suite.py docs/eval/suite/q05_16k_seeds10-16_pqvalues_device_h200.json \
        docs/eval/suite/q05_16k_seeds17-23_pqvalues_device_h200.json docs/eval/suite/q05_16k_seeds10-23_device_rankkeys_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from topk_decode.eval.paired import markdown, pool


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="suite result JSON files")
    args = p.parse_args(argv)
    try:
        instances = pool([json.loads(f.read_text()) for f in args.results])
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(instances)} questions from {len(args.results)} files\n")
    print(markdown(instances))
    return 0


if __name__ == "__main__":
    sys.exit(main())
