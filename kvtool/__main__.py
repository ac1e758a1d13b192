from kvtool.cli.app import main

main()
