from diagnoser.cli.app import main

main()
