"""Test tooling shipped with moonep_ep (never imported by the library except where a
``MOONEP_EP_*`` setting asks for it): the CUDA driver emulator."""
