"""Saves and loads at an s3:// URL against a plain s3fs upload/download of the same bytes,
on one moto S3 server started here (a process of its own, loopback), and the peak extra
memory (tracemalloc, which numpy reports to) of each.

    python -m benchmarks.objstore [MiB [save|load ...]]      # default 512, both

Prints one row per operation: trainrec's median seconds, s3fs's, and the speed ratio
(s3fs time / trainrec time: >= 0.8 is the target), and trainrec's peak extra memory
beside the largest tensor."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
import tracemalloc

import numpy as np


def _server() -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.environ.get("MOTO_LOG", os.devnull), "wb")  # noqa: SIM115  # the server's
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log)
    log.close()
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto's server did not start")


def main(mib: int = 512, only: tuple[str, ...] = ("save", "load")) -> None:
    proc, port = _server()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    try:
        import fsspec

        # a loaded machine's moto takes over botocore's 60 s to complete a 512 MiB upload;
        # a retry of CompleteMultipartUpload then fails in moto (500): wait, for both sides
        fsspec.config.conf.setdefault("s3", {})["config_kwargs"] = {"read_timeout": 900}
        from trainrec import NamedMpkFileRecorder, NativePrecisionSettings, TensorData

        fs = fsspec.filesystem("s3")
        fs.mkdir("bench")
        n = 8
        item = {f"t{i}": TensorData.from_array(np.random.default_rng(i).standard_normal(
            (mib << 20) // 4 // n, dtype=np.float32)) for i in range(n)}
        largest = max(t.nbytes for t in item.values())
        rec = NamedMpkFileRecorder(NativePrecisionSettings())
        url = "s3://bench/state.mpk"
        rec.save_item(item, url)
        data = fs.cat_file("bench/state.mpk")  # the same bytes, for s3fs
        fs.pipe_file("bench/plain.bin", data)
        rows = {}
        for label, ours, theirs in (r for r in (
            ("save", lambda: rec.save_item(item, url),
             lambda: fs.pipe_file("bench/plain.bin", data)),
            ("load", lambda: rec.read(url), lambda: fs.cat_file("bench/plain.bin")),
        ) if r[0] in only):
            t_ours, t_theirs, peak = [], [], 0
            for _ in range(3):
                tracemalloc.start()
                t0 = time.perf_counter()
                out = ours()
                t_ours.append(time.perf_counter() - t0)
                peak = max(peak, tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()
                del out
                t0 = time.perf_counter()
                out = theirs()
                t_theirs.append(time.perf_counter() - t0)
                del out
            a, b = statistics.median(t_ours), statistics.median(t_theirs)
            extra = peak - (len(data) if label == "load" else 0)  # a load's result is the state
            rows[label] = (a, b, extra)
            print(f"{label} {mib} MiB: trainrec {a:.2f} s, s3fs {b:.2f} s, ratio {b / a:.2f}x; "
                  f"peak extra memory {extra / 2**20:.0f} MiB (largest tensor "
                  f"{largest / 2**20:.0f} MiB + 64 MiB allowed)", flush=True)
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 512, tuple(sys.argv[2:]) or ("save", "load"))
