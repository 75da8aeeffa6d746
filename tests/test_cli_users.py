"""`gpupool user token NAME` and `user add NAME --show-token` for a user already added print the stored HTTP token
(the README's way to the dashboard's admin token); a name this CLI holds no credentials for is an error that says
why. No broker: the token is read from $GPUPOOL_HOME/credentials."""
from __future__ import annotations

import os
import subprocess
import sys

from infra import security


def _cli(home, *argv):
    env = {**os.environ, "GPUPOOL_HOME": str(home), "GPUPOOL_USER": "admin"}
    env.pop("GPUPOOL_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "agents.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_token_of_a_stored_principal_is_printed(tmp_path):
    admin = security.new_credentials("admin", "operator")
    security.save(tmp_path, admin)
    out = _cli(tmp_path, "user", "token", "admin")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == admin.token
    again = _cli(tmp_path, "user", "add", "admin", "--show-token")  # already added: no --role needed to see it
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == admin.token


def test_an_unknown_name_is_an_error_that_says_why(tmp_path):
    security.save(tmp_path, security.new_credentials("admin", "operator"))
    out = _cli(tmp_path, "user", "token", "mallory")
    assert out.returncode != 0
    assert "no credentials for 'mallory'" in out.stderr
    assert out.stdout == ""
    add = _cli(tmp_path, "user", "add", "mallory", "--show-token")  # not added: --role is still needed
    assert add.returncode != 0 and "needs --role" in add.stderr
