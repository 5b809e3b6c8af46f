from fedrcl.flower.simulation import main

main()
