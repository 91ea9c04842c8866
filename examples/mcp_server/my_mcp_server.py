"""An MCP tool server of your own, for the `mcp` 2.x SDK this project installs (`MCPServer`; 1.x called it FastMCP).

Its tools are offered to the model in the model's own template by a tools YAML entry (tools.yaml beside this file):

    tools:
      - mcp_server:
          command: [python, examples/mcp_server/my_mcp_server.py]

`python` there is the run's own interpreter (the one with `mcp` installed), not whatever `python` is first on PATH.
What the model reads when a tool fails: mcp 2.x withholds an exception's text from the client unless the tool
raises `ToolError` (any other exception reads as a generic "Error executing tool ..."). Raise ToolError with a
message the model can act on.
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("unit-converter")

FACTORS = {("km", "mi"): 0.621371, ("mi", "km"): 1.609344, ("kg", "lb"): 2.204623, ("lb", "kg"): 0.453592}


@app.tool()
def convert(value: float, unit_from: str, unit_to: str) -> str:
    """Convert a value between km and mi, or kg and lb."""
    factor = FACTORS.get((unit_from, unit_to))
    if factor is None:  # the model reads this message, and can retry with a pair that exists
        known = ", ".join(f"{a}->{b}" for a, b in FACTORS)
        raise ToolError(f"cannot convert {unit_from} to {unit_to}; known: {known}")
    return f"{value * factor:.4g} {unit_to}"


if __name__ == "__main__":
    app.run()
