"""Peak resident memory of one save or load, above the state itself, in a fresh process:

    python -m benchmarks.memory PEER save|load SIZE DIR

Prints one JSON line: {"peer", "op", "extra_bytes", "largest_tensor"}. The peak is
Linux's VmHWM, reset just before the operation (`/proc/self/clear_refs`).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> int:
    peer, op, size, directory = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    from benchmarks.peers import PEERS
    from benchmarks.state import sizes, training_state

    save, load = PEERS[peer]()
    path = directory / f"mem-{peer.split()[0].replace('/', '_')}"
    largest = max(sizes(size)) * 4
    state = training_state(size)
    if op == "save":
        gc.collect()
        reset_peak()
        base = _status("VmRSS")
        save(state, path)
        extra = _status("VmHWM") - base
    else:
        save(state, path)
        del state
        gc.collect()
        reset_peak()
        base = _status("VmRSS")
        loaded = load(path)
        state_bytes = sum(t.numel() * t.element_size() for t in loaded.values())
        extra = _status("VmHWM") - base - state_bytes
    print(json.dumps({"peer": peer, "op": op, "extra_bytes": max(0, extra), "largest_tensor": largest}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
