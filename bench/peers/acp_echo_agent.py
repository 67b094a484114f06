"""The ACP SDK's minimal example agent, restated for the benchmark: it answers
``initialize`` and ``session/new``, and answers each prompt by streaming its text back as
one ``agent_message_chunk`` before ``end_turn``. Nothing else: the floor an agent built
on the same SDK (``agent-client-protocol``) can reach."""

import asyncio
import uuid

from acp import PROTOCOL_VERSION, Agent, InitializeResponse, NewSessionResponse, PromptResponse, run_agent
from acp import update_agent_message_text
from acp.schema import AgentCapabilities, Implementation


class EchoAgent(Agent):
    def on_connect(self, conn):
        self.conn = conn

    async def initialize(self, protocol_version, client_capabilities=None, client_info=None, **kw):
        return InitializeResponse(protocol_version=PROTOCOL_VERSION, agent_capabilities=AgentCapabilities(),
                                  agent_info=Implementation(name="echo-agent", version="0"))

    async def new_session(self, cwd, additional_directories=None, mcp_servers=None, **kw):
        return NewSessionResponse(session_id=uuid.uuid4().hex)

    async def prompt(self, prompt, session_id, **kw):
        text = "".join(getattr(b, "text", "") for b in prompt)
        await self.conn.session_update(session_id=session_id, update=update_agent_message_text(text))
        return PromptResponse(stop_reason="end_turn")


if __name__ == "__main__":
    asyncio.run(run_agent(EchoAgent()))
