"""The one compiled part: streaming-store copies for snapshots and restores (tiered_ckpt/memcopy.py).

Everything else about the package is in pyproject.toml; setup.py only declares the extension, because
setuptools' ``ext-modules`` table in pyproject.toml is still marked experimental. ``optional``: where it cannot be
built (no C compiler) the install goes on, and the copies use glibc's memmove: the same bytes, slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tiered_ckpt._streamcopy", sources=["tiered_ckpt/_streamcopy.c"], optional=True)])
