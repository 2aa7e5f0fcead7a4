"""Starting kvstore in a child process (kvstore/child.py)."""


def test_children_run_this_kvstore_not_the_cwd_one(tmp_path, monkeypatch):
    import subprocess

    from kvstore import __version__
    from kvstore.child import env, kvstore_argv

    fake = tmp_path / "kvstore"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = 'the checkout in the cwd'\n")
    (fake / "cli.py").write_text("raise SystemExit('the checkout in the cwd ran')\n")
    monkeypatch.chdir(tmp_path)
    p = subprocess.run(kvstore_argv("--version"), env=env(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"kvstore {__version__}")
