"""What a request asks for: which endpoint, which model, and the routing text the engine will see.

The routing text is what the prefix index hashes. It must grow the way the engine's KV cache grows: for chat,
turn k's text is a prefix of turn k+1's, so a conversation keeps matching its own history.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any


class Endpoint(str, Enum):
    CHAT = "chat"                # POST /v1/chat/completions
    COMPLETION = "completion"    # POST /v1/completions
    GENERATE = "generate"        # POST /generate (SGLang native)
    EMBEDDING = "embedding"      # POST /v1/embeddings

    @property
    def generates(self) -> bool:
        return self is not Endpoint.EMBEDDING
