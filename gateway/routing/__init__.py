"""The choose step: the router, its policies, the per-backend prefix index and prefill backlog."""
