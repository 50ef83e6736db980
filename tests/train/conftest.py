import pytest


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A TFDS data directory per test module, where the embedded corpus is prepared once."""
    return str(tmp_path_factory.mktemp("tfds"))
