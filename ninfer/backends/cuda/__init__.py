"""The CUDA backend: device buffers allocated once, numba kernels and cuBLAS GEMMs on one stream, and one captured
CUDA graph per exact decode batch size. Importing it needs numba-cuda, cuda-python and nvmath-python (the `cuda`
extra) and, to run, an NVIDIA GPU."""
