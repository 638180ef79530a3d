# Source this at the start of a device run (carry .whl, and .whl-media where video decodes): installs the carried
# wheels into /tmp/site and puts them and the checkout on PYTHONPATH. Usage: `. tools/device_setup.sh && python3 -m
# pytest -m gpu ...`
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $(ls .whl-media/*.whl 2>/dev/null) || return 1
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Compiled kernels go in .kernel-cache (git-ignored; ninfer/kernels_numba/kernel_cache.py): a warm machine keeps it
# between calls, so a later call's processes load what an earlier one compiled (a fresh 35B-A3B bench process spent
# 100-200 s compiling), and tools/device_check.sh sends it back for the next session's first call to carry.
export NINFER_KERNEL_CACHE="${NINFER_KERNEL_CACHE:-$PWD/.kernel-cache}"
