"""A model for the tests that streams like a real one: run as a CLI model (provider ``cli``,
profile ``llm``), it prints its next reply in pieces with a pause between them.

argv: STATE_FILE REPLIES_JSON PIECES PAUSE_MS [PROMPT]. REPLIES_JSON is a list of replies
(a string, or ``{"json": value}`` printed as JSON), given out in order across calls; STATE_FILE
counts the calls, and STATE_FILE.prompts gets each call's PROMPT (what the model was given: the
conversation as the server rendered it), one JSON string a line. A token usage line goes to
stderr, as the ``llm`` CLI's ``-u`` prints it.
"""

import json
import sys
import time

state, replies, pieces, pause = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]) / 1000
try:
    with open(state) as f:
        n = int(f.read() or 0)
except FileNotFoundError:
    n = 0
if n >= len(replies):
    sys.exit(f"drip model: no reply left ({n} given)")
with open(state, "w") as f:
    f.write(str(n + 1))
prompt = sys.argv[5] if len(sys.argv) > 5 else ""
with open(state + ".prompts", "a") as f:
    f.write(json.dumps(prompt) + "\n")
reply = replies[n]
text = json.dumps(reply["json"]) if isinstance(reply, dict) else reply
size = max(1, -(-len(text) // pieces))
for i in range(0, len(text), size):
    sys.stdout.write(text[i:i + size])
    sys.stdout.flush()
    time.sleep(pause)
sys.stderr.write(f"Token usage: {len(prompt) // 4} input, {len(text) // 4} output\n")
