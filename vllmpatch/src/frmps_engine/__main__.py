from frmps_engine.cli import main

main()
