from unillm.cli import main

main()
