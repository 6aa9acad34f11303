"""Process-wide settings stay off in a user's own process: loading a model changes none of them."""

import os
import subprocess
import sys

SCRIPT = r"""
import gc, os, sys
rayon = os.environ.get("RAYON_NUM_THREADS")
from dask_surge import Encoder
from dask_surge.engine import allocator
enc = Encoder(sys.argv[1], device="cpu")
enc.load()
enc.encode(["a notebook loads a model", "and encodes two texts"])
enc.close()
print(allocator._done, gc.isenabled(), os.environ.get("RAYON_NUM_THREADS") == rayon)
"""


def test_a_notebook_process_keeps_its_allocator_gc_and_rayon_threads(tiny_model):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("RAYON_NUM_THREADS", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # mallopt never called (keep_large_blocks records each setting it applies), gc on, rayon untouched
    assert proc.stdout.split() == ["[]", "True", "True"]
