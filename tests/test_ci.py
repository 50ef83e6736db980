"""What CI runs (``.ci/run``, the ``Makefile``) agrees with the tests and ``pyproject.toml``:
every test marked ``colab`` lies in a path ``make test-colab`` names, and every version
pinned in ``.ci/colab-constraints.txt`` is one ``pyproject.toml`` admits."""
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# a module's ``pytestmark = pytest.mark.colab``, a test's decorator, or a parameter's marks
COLAB_MARK = re.compile(r"^pytestmark = pytest\.mark\.colab|^\s*@pytest\.mark\.colab$|marks=\[pytest\.mark\.colab\]",
                        re.MULTILINE)


def colab_test_paths() -> list[str]:
    makefile = ROOT.joinpath("Makefile").read_text().replace("\\\n", " ")
    return re.search(r"^COLAB_TESTS\s*=(.*)$", makefile, re.MULTILINE)[1].split()


def test_every_colab_test_lies_in_a_path_make_test_colab_runs():
    paths = colab_test_paths()
    marked = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/**/test_*.py")
                    if COLAB_MARK.search(p.read_text()))
    assert len(marked) >= 10, marked
    outside = [f for f in marked if not any(f == p or f.startswith(p.rstrip("/") + "/") for p in paths)]
    assert outside == [], f"marked colab but not in the Makefile's COLAB_TESTS: {outside}"
    assert [p for p in paths if not ROOT.joinpath(p).exists()] == []


def test_colab_pins_satisfy_the_declared_lower_bounds():
    project = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["tpu"]]
    pins = {}
    for line in ROOT.joinpath(".ci/colab-constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    assert pins["jax"] == "0.7.2" and pins["flax"] == "0.11.2" and pins["libtpu"] == "0.0.23"
    checked = {canonicalize_name(r.name): pins[canonicalize_name(r.name)] for r in declared
               if canonicalize_name(r.name) in pins}
    assert {"jax", "flax", "orbax-checkpoint", "optax", "chex", "numpy"} <= checked.keys()
    refused = [f"{r} excludes {pins[canonicalize_name(r.name)]}" for r in declared
               if canonicalize_name(r.name) in pins
               and not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)]
    assert refused == []
