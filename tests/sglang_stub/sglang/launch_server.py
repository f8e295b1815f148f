"""``python -m sglang.launch_server``: start a helper process, record the command line and
pids, then serve the model with ``asyncrl serve`` (see the package docstring).
``ASYNCRL_TEST_ARGV`` names the file that receives ``{argv, pid, helper}`` as JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from asyncrl.cli import main

parser = argparse.ArgumentParser()
parser.add_argument("--model-path", required=True)
parser.add_argument("--host", required=True)
parser.add_argument("--port", required=True)
parser.add_argument("--dtype", default="float32")
parser.add_argument("--api-key")
args, extra = parser.parse_known_args()
# A scheduler-like child in the server's process group (SGLang forks several): stopping
# the server must stop it too.
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
if record := os.environ.get("ASYNCRL_TEST_ARGV"):
    with open(record, "w") as f:
        json.dump({"argv": sys.argv[1:], "pid": os.getpid(), "helper": helper.pid}, f)
if "--fail-at-start" in extra:
    sys.exit("stub: asked to fail at start")
serve = ["serve", "--model", args.model_path, "--host", args.host, "--port", args.port]
key = ["--api-key", args.api_key] if args.api_key else []
sys.exit(main([*serve, "--dtype", args.dtype, *key]))
