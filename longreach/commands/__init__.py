"""The commands whose code lives in the engine itself: `generate` and `backends`, and the engine flags that
`generate`, `serve` and `bench decode` share. Each command module has HELP, DESCRIPTION, add_arguments(parser) and
main(args) -> int, as every command module does (bench/command.py, eval/command.py, server/command.py, demo.py,
calibrate.py, models/hub.py); longreach/cli.py registers them. Importing them imports no torch.
"""
