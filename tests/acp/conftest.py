import pytest


@pytest.fixture
def ws(tmp_path):
    """A workspace folder with one file, ``a.txt`` (``old text``)."""
    d = tmp_path / "ws"
    d.mkdir()
    (d / "a.txt").write_text("old text\n")
    return d
