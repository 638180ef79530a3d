# Source this at the start of a device run (carry .whl): installs the carried wheels into /tmp/site and puts them and
# the checkout on PYTHONPATH. Usage: `. tools/device_setup.sh && python3 -m pytest -m gpu ...`
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
