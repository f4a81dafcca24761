"""The one thing pyproject.toml cannot declare: the optional C form of the collective tracer's hot path
(agent/instrument/_hot.c). ``optional=True``: where no C compiler is found the build goes on without it and
meshscope runs its pure-Python path (agent/instrument/native.py says which one a process runs)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("meshscope.agent.instrument._hot", ["agent/instrument/_hot.c"], optional=True,
                             depends=["agent/instrument/_hot_common.h", "agent/instrument/_hot_sites.h",
                                      "agent/instrument/_hot_batch.h", "agent/instrument/_hot_funcol.h"],
                             extra_compile_args=["-O2", "-Wall", "-Werror=implicit-function-declaration"])])
