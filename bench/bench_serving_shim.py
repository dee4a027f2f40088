"""Runs SGLang's bench_serving (`python -m sglang.bench_serving`) from a throwaway venv that holds
`pip install sglang --no-deps` and the client side's pure-python dependencies only (aiohttp, numpy, orjson,
msgspec, requests, tqdm, transformers without torch, psutil, pyzmq, datasets, ...): importing the
`sglang` package itself would load torch. The two names the benchmark takes from `sglang.srt`, a constant and
the URL helpers of `sglang/srt/utils/network.py`, are provided: the constant's value, and that file loaded on
its own. Not part of loadlab and never imported by it; bench/client_cost.py runs it with --bench-serving.

    /tmp/bsvenv/bin/python bench/bench_serving_shim.py --backend sglang --base-url URL ...
"""

import importlib.util
import runpy
import sys
import types

root = importlib.util.find_spec("sglang").submodule_search_locations[0]
for name in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.utils"):
    package = types.ModuleType(name)
    package.__path__ = [root] if name == "sglang" else []
    sys.modules[name] = package
constants = types.ModuleType("sglang.srt.disaggregation.utils")
constants.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang 0.5.23's value
sys.modules[constants.__name__] = constants
spec = importlib.util.spec_from_file_location("sglang.srt.utils.network", f"{root}/srt/utils/network.py")
network = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = network
spec.loader.exec_module(network)
sys.argv[0] = "bench_serving"
runpy.run_module("sglang.bench_serving", run_name="__main__")
