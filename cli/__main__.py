from ragfix.cli.app import main

main()
