"""Decode-time decisions: when copying an expert pays (the cost model) and where capacity-padding rows are routed."""
