"""The NumPy stand-in kernel set offers every launcher the CUDA model calls, under the same names."""

from ninfer.backends.cuda import host_kernels, kernels


def test_the_host_set_defines_every_device_launcher():
    missing = [name for name in kernels.__all__ if not hasattr(host_kernels, name)]
    assert not missing
    assert host_kernels.__all__ == kernels.__all__
