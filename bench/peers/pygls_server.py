"""Bare pygls 2.1.1 JsonRPCServer peer: initialize, ping, add (+ shutdown/exit).

Runs in bench/.venvs/pygls.  Nothing is added on top of what pygls ships, so
this is the cost of the framework our server is built on.
"""
import sys

from pygls.protocol import JsonRPCProtocol, default_converter
from pygls.server import JsonRPCServer

server = JsonRPCServer(protocol_cls=JsonRPCProtocol, converter_factory=default_converter)


@server.feature("initialize")
def initialize(ls, params):
    return {"protocolVersion": 1, "serverInfo": {"name": "bare-pygls", "version": "2.1.1"},
            "capabilities": {"methods": ["initialize", "ping", "add", "shutdown"]}}


@server.feature("ping")
def ping(ls, params):
    return {}


@server.feature("add")
def add(ls, params):
    return getattr(params, "a", 0) + getattr(params, "b", 0)


@server.feature("shutdown")
def shutdown(ls, params):
    return None


@server.feature("exit")
def exit_(ls, params):
    ls.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    server.start_io()
