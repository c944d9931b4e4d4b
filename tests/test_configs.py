"""Every config file parses, and bad configs give clear errors."""

import glob
import os

import pytest

from bloomery_jax.errors import ConfigError
from bloomery_jax.settings import CONFIG_DIR, RuntimeSettings, load_settings

CONFIG_FILES = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.gin")))


def test_config_dir_has_files():
    assert os.path.basename(CONFIG_FILES[0]) and "base.gin" in map(os.path.basename, CONFIG_FILES)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_every_config_parses(path):
    assert isinstance(load_settings([path]), RuntimeSettings)


def test_family_file_overrides_base():
    base = load_settings([os.path.join(CONFIG_DIR, "base.gin")])
    gemma = load_settings([os.path.join(CONFIG_DIR, "gemma3.gin")])
    assert gemma.max_context != base.max_context and gemma.ubatch == base.ubatch


def test_binding_overrides_file():
    s = load_settings([os.path.join(CONFIG_DIR, "base.gin")], ["RuntimeSettings.ubatch = 1024"])
    assert s.ubatch == 1024


@pytest.mark.parametrize(
    "binding, fragment",
    [
        ("RuntimeSettings.ubatch = 0", "ubatch"),
        ("RuntimeSettings.ubatch = 8192", "ubatch"),
        ("RuntimeSettings.kernels = 'cuda'", "kernels"),
        ("RuntimeSettings.bridge = 'pipe'", "RuntimeSettings.bridge must be one of"),
        ("RuntimeSettings.routing = 'sort'", "RuntimeSettings.routing must be one of"),
        ("RuntimeSettings.attention = 'flash'", "RuntimeSettings.attention must be one of"),
        ("RuntimeSettings.decode_block = -1", "RuntimeSettings.decode_block must be 0"),
        ("RuntimeSettings.no_such_field = 1", "no_such_field"),
        ("RuntimeSettings.ubatch = ", "gin"),
    ],
)
def test_bad_binding_is_a_clear_error(binding, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_settings([], [binding])


def test_missing_file_is_a_clear_error():
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(["/nonexistent/x.gin"])
