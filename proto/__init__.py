"""trainscope."""
