"""Stdlib floor: the least a Content-Length JSON-RPC stdio server can do.

Answers initialize, ping, add, shutdown; exits on `exit` or stdin EOF.
"""
import json
import sys


def main() -> int:
    rd = sys.stdin.buffer
    wr = sys.stdout.buffer
    shut = False
    while True:
        length = None
        while True:
            line = rd.readline()
            if not line:
                return 0
            line = line.strip()
            if not line:
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            continue
        msg = json.loads(rd.read(length))
        method = msg.get("method")
        if "id" not in msg:
            if method == "exit":
                return 0 if shut else 1
            continue
        params = msg.get("params") or {}
        if method == "initialize":
            result = {"protocolVersion": 1, "serverInfo": {"name": "stdlib-echo", "version": "0"},
                      "capabilities": {"methods": ["initialize", "ping", "add", "shutdown"]}}
        elif method == "ping":
            result = {}
        elif method == "add":
            result = params.get("a", 0) + params.get("b", 0)
        elif method == "shutdown":
            shut = True
            result = None
        else:
            body = json.dumps({"jsonrpc": "2.0", "id": msg["id"],
                               "error": {"code": -32601, "message": f"method not found: {method}"}})
            data = body.encode()
            wr.write(b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            wr.flush()
            continue
        data = json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}).encode()
        wr.write(b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        wr.flush()


if __name__ == "__main__":
    sys.exit(main())
