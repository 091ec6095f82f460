"""How a process that streamed Hub Parquet shards ends (``formats._end_hub_streams``): the
streams still open are closed while the interpreter is whole, and the exit waits for the files
that only native code (Arrow's threads) still holds. A thread that needs the GIL to let go of
one after finalisation began aborts the process ("terminate called without an active
exception"): the benchmark test of Hub resumes failed so on a busy machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import atexit, ctypes, io, os, sys, threading, time
import pyarrow as pa
import pyarrow.parquet as pq

work, tokenizer = sys.argv[1], sys.argv[2]
# Row groups of 2048 rows: a stream holds the rest of its row group after the first 1024.
pq.write_table(pa.table({"text": [f"document {i}" for i in range(2048 * 4)]}),
               os.path.join(work, "part.parquet"), row_group_size=2048)

from tape_train.data.config import DataConfig
from tape_train.data.formats import SkipLog, hub_shards, read_documents

cfg = DataConfig(sources=[{"hub": "parquet", "data_files": os.path.join(work, "*.parquet")}],
                 tokenizer=tokenizer)
dataset, shards = hub_shards(cfg.sources[0])
streams = []
for shard in shards:  # one document of each row group; the streams are left open to the end
    stream = read_documents(shard, 0, "text", False, SkipLog(), dataset)
    next(stream)
    streams.append(stream)


class Released(io.BufferedReader):
    def __del__(self):
        os.write(1, b"released\n")


# A closed file that only native code holds (a reference Python's gc cannot see, as Arrow's
# threads hold the files they read), let go by another thread once the exit has begun.
held = Released(io.FileIO(os.path.join(work, "part.parquet")))
held.close()
address = id(held)
ctypes.pythonapi.Py_IncRef(ctypes.py_object(held))
del held
exiting = threading.Event()
atexit.register(exiting.set)  # registered last: runs first, before the data handlers


def let_go():
    exiting.wait()
    time.sleep(2)  # a thread starved on a busy machine
    ctypes.pythonapi.Py_DecRef.argtypes = [ctypes.c_void_p]
    ctypes.pythonapi.Py_DecRef(address)


threading.Thread(target=let_go, daemon=True).start()
print("read", len(streams), flush=True)
"""


def test_open_streams_are_closed_and_native_holds_let_go_before_the_interpreter_ends(
        tmp_path, tok):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(tok.path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                               "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == "read 4", proc.stdout
    # The exit waited for the thread holding the file (without the wait it is cut off).
    assert "released" in proc.stdout.splitlines(), proc.stdout + proc.stderr
    # Streams left to the interpreter's teardown raise there once its modules are gone.
    assert "Exception ignored" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
