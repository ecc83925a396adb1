from attnkit.cli import main

main()
