from .commands.cli import console

if __name__ == "__main__":  # worker processes import the main module; they must not run the CLI
    console()
