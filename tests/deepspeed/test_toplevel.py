"""The meta-package's top-level names: cheap to import, resolved on first use."""

import subprocess
import sys

import pytest

import deepspeed


def test_import_deepspeed_does_not_import_torch():
    code = "import sys, deepspeed; assert 'torch' not in sys.modules, 'torch imported'; print(deepspeed.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0.19.2"


@pytest.mark.parametrize("name", sorted(deepspeed._LAZY))
def test_lazy_names_resolve_to_their_modules(name):
    module, attribute = deepspeed._LAZY[name]
    value = getattr(deepspeed, name)
    source = sys.modules[module]
    assert value is (source if attribute is None else getattr(source, attribute))
    assert name in dir(deepspeed)


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'initialise'"):
        deepspeed.initialise  # noqa: B018
