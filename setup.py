"""Build the C core (`velox._native`).

Only the extension is declared here; all metadata lives in pyproject.toml. The flags are the
project's contract for its C code: C11, warning-free under -Wall -Wextra -Werror.
"""

from setuptools import Extension, setup

# The module file (state and init), one binding file per core, then the Python-free cores.
BINDINGS = ["ring", "stats", "health", "cache", "h2", "hash", "json", "limits",
            "http1", "reqhead", "relay", "books", "h1resp", "budgets", "sink", "spend"]
NATIVE_SOURCES = [
    "native/_velox_native.c",
    *(f"native/bind_{name}.c" for name in BINDINGS),
    "native/vx_ring.c",
    "native/vx_stats.c",
    "native/vx_json.c",
    "native/vx_health.c",
    "native/vx_cache.c",
    "native/vx_limits.c",
    "native/vx_shm.c",
    "native/vx_hpack.c",
    "native/vx_h2.c",
    "native/vx_http1.c",
    "native/vx_reqhead.c",
    "native/vx_books.c",
    "native/vx_h1resp.c",
    "native/vx_spend.c",
]

# Hidden: the binding files' shared vxb_* symbols stay inside each extension.
FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"]

setup(
    ext_modules=[
        Extension("velox._native", sources=NATIVE_SOURCES, include_dirs=["native"],
                  extra_compile_args=FLAGS),
        # The lone token bucket, which only the benchmarks and its tests use: the lab's.
        Extension("velox_lab._bucket", sources=["native/lab_bucket.c", "native/vx_bucket.c"],
                  include_dirs=["native"], extra_compile_args=FLAGS),
    ],
)
