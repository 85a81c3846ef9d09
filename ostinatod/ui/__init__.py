"""The UI clients: `ostinato tui` (Textual) and the tray icon (pystray).

They talk to the daemon only through the control API (:mod:`ostinatod.control.client`) and never
import the engine (tests/unit/test_import_rules.py pins that).
"""
