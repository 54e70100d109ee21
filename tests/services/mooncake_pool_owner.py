"""A standalone Mooncake Store client that only owns memory: it mounts a segment of
``--segment`` bytes into the pool and then sleeps until SIGTERM.

Objects live in the segment of the client that put them *unless* the writer mounts no segment of
its own (``global_segment_size=0``, what ``MooncakeTier`` does): then the master places them in a
segment like this one, which outlives every engine. When this process exits, its segment and every
object in it vanish (Mooncake's semantics; the tests check that the tier treats it as a miss).

Run by ``tests.services.mooncake.MooncakeCluster``; prints READY once mounted.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--segment", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args()
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(args.host, args.metadata, args.segment, 16 * 2**20, "tcp", "", args.master)
    if rc != 0:
        print(f"setup failed rc={rc}", flush=True)
        return 1
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print("READY", flush=True)
    done.wait()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
