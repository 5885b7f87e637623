"""The one backend fixture: every test that takes `device` runs on every available device.

TILEFUSE_TEST_DEVICES=ref,cpu restricts the list; a device kind that is unavailable here is
reported as a skip with the reason, so the suite shows what did not run."""
from __future__ import annotations

import os

import numpy as np
import pytest

import tilefuse as tx
# one tolerance table and comparison for the tests and `python -m tilefuse.validate`
from tilefuse.validate.compare import assert_close, tolerance  # noqa: F401

ALL_KINDS = ("ref", "cpu", "opencl", "cuda", "webgpu")


def _device_params():
    wanted = [s.strip() for s in os.environ.get("TILEFUSE_TEST_DEVICES", "").split(",") if s.strip()]
    present, missing = tx.devices(all=True)
    params = []
    for d in present:
        if not wanted or d.name in wanted or d.kind in wanted:
            params.append(pytest.param(d.name, id=d.name))
    for kind, why in missing.items():
        if not wanted or kind in wanted:
            params.append(pytest.param(kind, id=kind, marks=pytest.mark.skip(reason=f"{kind}: {why}")))
    return params


DEVICE_PARAMS = _device_params()

# The suite tests each device's compiled kernels: jitted calls compile at once (here and in the
# processes tests start) unless TILEFUSE_TIERED is set (CI runs the tracer and autodiff tests
# with tiering forced on too).
if "TILEFUSE_TIERED" not in os.environ:
    os.environ["TILEFUSE_TIERED"] = "0"
    tx.config.tiered = False


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICE_PARAMS, indirect=True)


@pytest.fixture
def device(request):
    """The device under test, made the default for the test's duration. On PoCL, every program
    the test built must have built with the declarations of its builtins alone (not opencl-c.h:
    backends/opencl/prelude.py), or the test fails naming them."""
    old = tx.config.default_device
    tx.config.default_device = request.param
    dev = tx.get_device(request.param)
    programs = dev.backend.programs if dev.kind == "opencl" else None
    seen = len(programs.header_builds) if programs is not None else 0
    try:
        yield dev
    finally:
        tx.config.default_device = old
    if programs is not None and len(programs.header_builds) > seen:
        pytest.fail(f"PoCL built {programs.header_builds[seen:]} only with opencl-c.h: a builtin is missing "
                    "from backends/opencl/prelude.py")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that needs a dtype its device cannot hold (float64 on WebGPU: the device refuses it
    with UnsupportedDTypeError) is skipped there, with the device's reason."""
    from tilefuse.ir.errors import UnsupportedDTypeError
    try:
        return (yield)
    except UnsupportedDTypeError as e:
        pytest.skip(str(e).splitlines()[0])
