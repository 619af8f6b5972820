"""The README stays true: its config reference is what `veriloco config` prints."""

from conftest import ROOT

from veriloco.config import describe


def test_readme_config_reference_is_current():
    text = (ROOT / "README.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "\n<!-- config-reference:end -->"
    assert start in text and end in text
    section = text.split(start, 1)[1].split(end, 1)[0]
    assert section.strip() == describe().strip(), "run `veriloco config` and paste it into README.md"


def test_readme_opens_with_the_two_commands():
    head = (ROOT / "README.md").read_text().split("##", 1)[0]
    assert "make run" in head and "make test" in head
