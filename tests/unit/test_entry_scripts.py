"""The commands the README and CI start directly must be committed executable: a clean clone takes the mode
from git, not from the author's working tree (535beb4 once dropped the bit from scripts/test.sh, and .ci/run's
`exec scripts/test.sh all` would have been refused)."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_shell_script_and_the_ci_entry_point_are_committed_executable():
    out = subprocess.run(["git", "ls-files", "-s", "--", "*.sh", ".ci/run"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    modes = {line.split()[3]: line.split()[0] for line in out.splitlines()}
    assert {".ci/run", "scripts/test.sh", "scripts/setup.sh", "scripts/demo.sh", "testbed/build.sh"} <= set(modes), modes
    assert {p: m for p, m in modes.items() if m != "100755"} == {}
