# fish completion for lanelock (lanelock completion fish)
function __lanelock_complete
    lanelock completion fish --complete (commandline -cp) 2>/dev/null \
        | while read -l -d \t type value extra
        switch $type
            case dir
                for path in (__fish_complete_directories $value)
                    echo $extra$path
                end
            case file
                for path in (__fish_complete_path $value)
                    echo $extra$path
                end
            case plain
                if test -n "$extra"
                    printf '%s\t%s\n' $value $extra
                else
                    echo $value
                end
        end
    end
end
complete -c lanelock -f -a '(__lanelock_complete)'
