"""numba-cuda kernels of the CUDA backend, each module with its NumPy twin (`*_reference` functions).

Importing a module here needs numba-cuda, not a GPU: kernels are lazy dispatchers, compiled on first launch. CI
compiles every registered kernel to PTX for sm_90 (`tests/kernels/test_ptx.py`) so typing errors surface without one.
"""
