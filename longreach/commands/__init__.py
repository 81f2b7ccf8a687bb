"""The commands whose code lives in the engine itself: `generate` and `backends`, and the engine flags that
`generate`, `serve` and `bench decode` share. Each command module has HELP, DESCRIPTION, add_arguments(parser) and
main(args) -> int, as every command module does (server/command.py, models/hub.py, and the lab's
tools/bench/command.py, tools/eval/command.py, tools/demo.py, tools/calibrate.py); longreach/cli.py registers them.
Importing them imports no torch.
"""
