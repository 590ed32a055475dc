from stalwart.cli import run

run()
