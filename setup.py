"""Build step for the one compiled module; the project's metadata lives in pyproject.toml.

``cachestore.format._gather`` (a verified batch gather without the GIL) is optional: where it cannot be
built (no C compiler), the install still succeeds and reads use the pure-Python gather.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("cachestore.format._gather", ["cachestore/format/_gather.c"], optional=True,
                             extra_compile_args=["-O3", "-Wall", "-Wextra", "-Wno-missing-field-initializers"])])
