"""MoonEP's prepare and finalize steps in vLLM's modular kernel: the plugin's capacity padding and the push API's prepare."""
