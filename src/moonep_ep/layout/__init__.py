"""Sharded expert-weight views over symmetric memory."""
